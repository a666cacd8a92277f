"""Tool use: call formats per model family, the registry of callable tools, a chat turn with tools, and
the tool loop that runs calls and feeds their results back."""

"""One router module per task, and the server's own routes."""

"""The `transcribe` task: whisper's runner (encoder, cross K/V, cached decoder steps), its token search
(CTranslate2's greedy, beam and sampling with whisper's logit rules) and faster-whisper's long-form
transcription over it."""

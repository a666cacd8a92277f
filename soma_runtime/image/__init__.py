"""Images: decoding what a request sends (io) and the preprocessing vision models' processors do
(preprocess), independent of any model or hardware."""

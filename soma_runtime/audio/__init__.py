"""Audio: the front ends speech models read (log-mel features), independent of any model."""

"""soma model directories (config.toml + chat.toml + sampling.toml) — placeholder until import lands."""

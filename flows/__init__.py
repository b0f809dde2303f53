"""The loop: config, the self_improve and round flows, MLflow tracking, the CLI."""

"""The gateway's HTTP API (OpenAI-compatible images, health, control), on when --http-port is set."""

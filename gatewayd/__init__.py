"""llm-gateway: one OpenAI-compatible endpoint in front of local engines run as systemd units."""

__version__ = "0.1.0"

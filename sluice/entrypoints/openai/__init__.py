"""The OpenAI-compatible server (`sluice serve`): see api_server.py."""

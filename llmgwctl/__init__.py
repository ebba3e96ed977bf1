"""llmgw: a self-hosted LLM gateway for GPU fleets. `llmgwctl` is its one command."""
__version__ = "0.1.0"

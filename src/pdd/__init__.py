"""PDD: cross-datacenter Prefill / RelayDecode / MainDecode LLM serving."""

__version__ = "0.1.0"

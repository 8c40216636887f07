"""lowproxy: a small, fast prefill/decode proxy for disaggregated LLM serving."""

__version__ = "0.1.0"

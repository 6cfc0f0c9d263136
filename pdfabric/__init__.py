"""pdfabric: a disaggregated prefill/decode LLM serving fabric."""

__version__ = "0.1.0"

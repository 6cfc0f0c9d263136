"""The prefill worker: chunked prefill, KV shipping to decode workers, first token."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level prefill/ folder in the source tree


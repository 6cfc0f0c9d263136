"""The prefill kind: its core (chunked prefill, first token) and its sending KV side."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level prefill/ folder in the source tree


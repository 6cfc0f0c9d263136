"""The decode worker (KV from prefill workers) and the colocated worker (prefill and decode in one)."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level decode/ folder in the source tree


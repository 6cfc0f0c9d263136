"""The HTTP front: OpenAI-compatible API, worker registry, request dispatch, metrics."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level router/ folder in the source tree


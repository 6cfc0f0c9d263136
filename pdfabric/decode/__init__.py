"""The decode kind (KV from prefill workers, received into reserved blocks) and the colocated kind
(prefill and decode in one): their cores and the receiving KV side."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level decode/ folder in the source tree


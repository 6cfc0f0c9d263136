"""The model runtime every worker shares: config, loader, model, paged KV cache, sampler, tokenizer."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level engine/ folder in the source tree


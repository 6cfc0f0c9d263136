"""The table of worker kinds: each kind's core and KV side, as the worker process, the simulator and
the tests look them up."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level kinds/ folder in the source tree

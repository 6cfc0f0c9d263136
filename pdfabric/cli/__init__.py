"""The top of the house: the ``pdfabric`` command line and what its commands start (the launcher and
its supervisor, Ray placement, the autoscaler, the worker process entry, profiling, the admin client)."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level cli/ folder in the source tree

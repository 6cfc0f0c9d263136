"""What every worker kind shares: the base core (admission, scheduling, the messages a step returns)
and the process loop around it. The kinds themselves are in prefill/ and decode/; the process entry
that picks one is ``pdfabric.cli.worker_cli``."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level worker/ folder in the source tree

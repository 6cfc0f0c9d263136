"""What every worker kind shares: the base core (admission, scheduling, the messages a step returns),
its spec, the KV side's commands and interface, the ``WorkerKind`` value, and the process loop and
entry around them. The kinds themselves are in prefill/ and decode/, listed in ``pdfabric.kinds``."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level worker/ folder in the source tree

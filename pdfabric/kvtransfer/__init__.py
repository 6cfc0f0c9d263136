"""Moving paged KV blocks between processes.

``sender.KVSender`` (prefill side) and ``receiver.KVReceiver`` (decode side) are the state machines
workers poll; ``reservations.BlockReservations`` is the receiver's (and sender's) record of blocks held
per transfer; ``messages`` is the KV channel's wire format; ``transport_zmq``, ``transport_shm`` (with
``shm_pool.SharedKVPool``) and ``transport_dist`` move the bytes. Nothing is imported here, so the
torch-free modules (``config``, ``messages``, ``reservations``, ``state``) stay importable without
torch.
"""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level kvtransfer/ folder in the source tree


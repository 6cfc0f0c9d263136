"""The request core and its dispatch: the router's decisions about requests and workers as an
I/O-free core (``core.RouterCore``, with ``placement`` walking a request's routes and ``failover``
moving it off failed workers), the effects it returns, and the dispatcher that carries them out
over the control socket."""

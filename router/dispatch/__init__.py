"""The request core and its dispatch: the router's decisions about requests and workers as an
I/O-free core (``core.RouterCore``), the effects it returns, and the dispatcher that carries them out
over the control socket."""

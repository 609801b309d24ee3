"""Actors (ClientWorker, Server, Adversary, Mixer) and the backends that host them (ray, inline)."""

from simulator.runtime.actors import Adversary, Mixer, Server
from simulator.runtime.backend import Backend, InlineBackend, RayBackend, make_backend
from simulator.runtime.worker import ClientWorker

__all__ = ["Adversary", "Backend", "ClientWorker", "InlineBackend", "Mixer", "RayBackend", "Server",
           "make_backend"]

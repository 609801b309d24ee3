"""Actors (ClientWorker, Server, Adversary, Mixer) and the backends that host them (ray, inline)."""

from simulator.runtime.adversary import Adversary
from simulator.runtime.backend import Backend, InlineBackend, RayBackend, make_backend
from simulator.runtime.mixer import Mixer
from simulator.runtime.server import Server
from simulator.runtime.worker import ClientWorker

__all__ = ["Adversary", "Backend", "ClientWorker", "InlineBackend", "Mixer", "RayBackend", "Server",
           "make_backend"]

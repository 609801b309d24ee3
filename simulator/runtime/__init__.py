"""Actors (ClientWorker, Server, Adversary) and the backends that host them (ray, inline)."""

from simulator.runtime.actors import Adversary, ClientWorker, Server
from simulator.runtime.backend import Backend, InlineBackend, RayBackend, make_backend

__all__ = ["Adversary", "Backend", "ClientWorker", "InlineBackend", "RayBackend", "Server", "make_backend"]

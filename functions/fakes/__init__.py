"""Fakes that ship with the product, so users test their functions against real sockets
instead of patching clients (see ``openai_server.FakeOpenAI``)."""

from functions.fakes.openai_server import FakeOpenAI, RecordedRequest, Scripted

__all__ = ["FakeOpenAI", "RecordedRequest", "Scripted"]

"""Executors: how the engine drives its workers (in-process, ZMQ worker processes, TP groups).

The engine calls only the `Executor` interface and does not know which one it drives.
"""
from services.engine.executor.base import Executor

__all__ = ["Executor"]

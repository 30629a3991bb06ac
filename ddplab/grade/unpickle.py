"""What the grading worker takes from the submission's processes: plain data, and code it keeps sealed.

The worker runs every check itself (``ddplab.grade.witness``), but what
it checks comes from processes the submission controls: the ranks' replies,
and the names a check cell gives the checker (``swap``, ``waited``), which
the kernel sends as bytes. Unpickling either could run the submission's code
in the worker (a ``__reduce__`` gadget), so:

- ``SafeUnpickler`` loads plain data and tensors only (``SAFE_GLOBALS``); any
  other global refuses the whole load, before anything in it ran.
- What it refuses from the kernel (a function, a class, an object of the
  student's) becomes ``Sealed``: the bytes, never loaded here. Pickled, a
  ``Sealed`` is the kernel's own bytes again, so a checker that hands it to
  the ranks (``lab.run(trial, fn, case)``) sends what the kernel's own call
  would have sent, and the *rank* unpickles it. Called here, it raises.
- A few of ddplab's own records (``RECORDS``: a ``Launch``) come as their
  fields, plain data, and are built here by their class; the last trace of
  the kernel (``ddplab.trace.last()``, what the timeline checkers read) comes
  as its events' fields and is rebuilt with ``ddplab.trace.Event``. Nothing
  the kernel sends picks a class or a method that runs here.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

#: What a rank's answer (or the kernel's data) may be built from: plain types, OrderedDict, tensors.
SAFE_GLOBALS = {
    ("builtins", name) for name in ("set", "frozenset", "complex", "slice", "range", "bytearray",
                                    "list", "dict", "tuple", "int", "float", "bool", "str", "bytes")
} | {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
     ("torch._utils", "_rebuild_parameter"), ("torch", "Size"), ("torch", "device")}


def _tensor_storage(data: bytes) -> Any:
    """``torch.storage._load_from_bytes``, but with torch's weights-only unpickler."""
    import torch
    return torch.load(io.BytesIO(data), weights_only=True)


class SafeUnpickler(pickle.Unpickler):
    """Unpickles plain data and tensors; refuses any other global (a ``__reduce__`` gadget)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _tensor_storage
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a rank sent a {module}.{name}, which the grader does not "
                                     f"unpickle (plain data and tensors only)")


def safe_loads(data: bytes) -> Any:
    """``data`` unpickled as plain data; ``pickle.UnpicklingError`` for anything else.

    Any failure counts as a refusal: a crafted pickle that makes a tensor's
    rebuild raise is as unreadable as one that names a gadget.
    """
    try:
        return SafeUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:
        raise pickle.UnpicklingError(f"the grader could not unpickle it ({type(e).__name__}: "
                                     f"{e})") from e


class Refused(str):
    """A rank's reply the grader would not unpickle; why, as text."""


class SafePickle:
    """What ipyparallel's serializer sees as ``pickle`` in the worker: safe ``loads``."""
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
    DEFAULT_PROTOCOL = pickle.DEFAULT_PROTOCOL
    PickleError = pickle.PickleError
    dumps = staticmethod(pickle.dumps)

    @staticmethod
    def loads(data: bytes, **_: Any) -> Any:
        # Not raised: ipyparallel unpickles replies in its own thread, where an
        # exception would lose the reply and the check would wait for it in vain.
        try:
            return safe_loads(data)
        except pickle.UnpicklingError as e:
            return Refused(str(e))


def _send_back(data: bytes) -> Any:
    """Where a ``Sealed`` is unpickled (a rank): the kernel's bytes, loaded as the kernel sent them."""
    import cloudpickle
    return cloudpickle.loads(data)


class Sealed:
    """A value of the notebook's that the grader never unpickles: a function, a class, an object.

    ``__name__`` is what the kernel said it was called (for a checker's
    messages). Pickled, it unpickles as the kernel's bytes, where it lands;
    a checker passes it to the ranks as it would the student's function.
    """

    def __init__(self, name: str, data: bytes, label: str) -> None:
        self.name, self.data, self.__name__ = name, data, label

    def __reduce__(self) -> tuple:
        return (_send_back, (self.data,))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"ddplab grade: `{self.name}` is the notebook's code, which the grader "
                        f"never runs in its own process; a checker runs it on the ranks "
                        f"(lab.run), where the submission's code runs anyway.")

    def __repr__(self) -> str:
        return f"<{self.__name__} from the notebook>"


def _records() -> dict[str, type]:
    """ddplab's records a check cell may be given, by ``module.qualname``: built from their fields."""
    from ..launch import Launch
    # Named as the kernel names it (``witness.ASK``: the class's module and qualname), from the
    # class itself, so that moving it (``launch/job.py``) cannot leave the name behind.
    return {f"{record.__module__}.{record.__qualname__}": record for record in (Launch,)}


def load_name(name: str, answer: Any) -> Any:
    """The value of ``name`` from the kernel's answer: plain data, a built record, or ``Sealed``.

    ``answer`` is ``("pickle", bytes, label)``, ``("record", kind, bytes of
    its fields)`` or ``("unreadable", why)``; AssertionError for anything
    the grader cannot use (the check then fails, as it would in the kernel).
    """
    kind = answer[0] if isinstance(answer, tuple) and answer else None
    if kind == "pickle" and len(answer) == 3 and isinstance(answer[1], bytes):
        try:
            return safe_loads(answer[1])
        except pickle.UnpicklingError:
            label = answer[2] if isinstance(answer[2], str) else name
            return Sealed(name, answer[1], label)
    if kind == "record" and len(answer) == 3 and answer[1] in _records():
        try:
            fields = safe_loads(answer[2]) if isinstance(answer[2], bytes) else None
            if isinstance(fields, dict):
                return _records()[answer[1]](**fields)
        except (pickle.UnpicklingError, TypeError) as e:
            raise AssertionError(f"the grader could not read `{name}` from the notebook "
                                 f"({e})") from e
    why = answer[1] if kind == "unreadable" and len(answer) == 2 else "an answer it cannot use"
    raise AssertionError(f"the grader could not read `{name}` from the notebook ({why}).")


def load_trace(data: bytes | None) -> Any:
    """The kernel's last trace, rebuilt from its events' fields, or None if it had none."""
    if data is None:
        return None
    from ..trace import Event, Trace
    try:
        found = safe_loads(data)
        trace = Trace(_Stopped(list(found["ranks"])))
        trace.events = [Event(**row) for row in found["events"]]
        trace.compute = [Event(**row) for row in found["compute"]]
    except (pickle.UnpicklingError, TypeError, KeyError) as e:
        raise AssertionError(f"the grader could not read the notebook's last trace ({e})") from e
    trace.complete = True
    return trace


class _Stopped:
    """The lab of a trace rebuilt from its events: it records nothing more."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks

    def check_ranks(self, ranks: Any) -> list[int]:
        return self.ranks

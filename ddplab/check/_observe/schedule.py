"""Forward, backward and activations of the checker's own modules, seen by hooks the checker installs.

A pipeline schedule or an overlap hook is judged by what happened, not by what
the student's object says happened: ``stage.log`` is a list the student's code
can append to, clear or overwrite, and a pass line built from it states what
the list says. ``Watch`` records, into a ``record.Record`` (the same sequence as
``wire``'s ops, or one of its own), from hooks on objects the checker made:

- ``forwards(module, name)``: a mark ``"F"`` each time the module runs
  (a forward hook: however the student's code reaches it, ``stage(x)``,
  ``stage.block(x)`` or ``functional_call``), numbered by call; and a mark
  ``"B"`` with the same number when the gradient of that call's output arrives
  (a hook on the output tensor the checker's forward hook registers), which is
  when backward reaches the module for that micro-batch.
- ``gradients(params)``: a mark ``"grad"`` each time autograd has accumulated
  a parameter's gradient (``register_post_accumulate_grad_hook``, registered by
  the checker after the student's own hooks, so it runs after them).
- ``held()``: while the block runs, every tensor autograd saves for backward
  goes through ``torch.autograd.graph.saved_tensors_hooks``; those saved during
  a watched module's call count for that call until autograd lets go of them
  (after its backward). ``Watch.peak`` is the most calls whose activations were
  held at once: memory the rank really held, whatever the student's log says.

What a student's code could still do on its own rank: compute with the
module's weights without calling the module (no ``"F"``; its saved tensors are
``Watch.stray``), or remove the hooks by walking the interpreter. A check that
needs the first refused compares ``stray`` with zero.

How a checker uses this (on a rank)::

    record = Record()                      # or the one wire.recording() yields
    watch = Watch(record)
    watch.forwards(stage.block, "stage")
    with watch.held():
        student(stage, inputs, targets)
    watch.remove()
    order = watch.order("stage")           # [("F", 0), ("F", 1), ("B", 0), ...]
    return {"order": order, "peak": watch.peak}
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

from .record import Record

__all__ = ["Watch"]


class _Saved:
    """What autograd keeps instead of a saved tensor while ``held()`` counts: the tensor, and whose."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


class Watch:
    """The checker's hooks on its own modules and parameters, writing marks into ``record``."""

    def __init__(self, record: Record) -> None:
        self.record = record
        self.handles: list[Any] = []
        self.calls: dict[str, int] = {}          # module name -> forwards so far
        self.live: dict[tuple[str, int], int] = {}   # (module, call) -> saved tensors alive
        self.peak = 0
        self.stray = 0                           # tensors saved outside any watched call
        self._running: list[tuple[str, int]] = []

    # ------------------------------------------------------------ modules
    def forwards(self, module: Any, name: str) -> None:
        """Mark each forward of ``module`` ("F") and the backward through its output ("B")."""
        import torch

        def before(mod: Any, args: Any) -> None:
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            self._running.append((name, call))
            self.record.mark("F", module=name, call=call)

        def after(mod: Any, args: Any, output: Any) -> None:
            name_call = self._running.pop() if self._running else (name, -1)
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for out in outputs:
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(self._backward_mark(*name_call))
                    break                    # one mark per call: its first differentiable output

        self.handles.append(module.register_forward_pre_hook(before))
        self.handles.append(module.register_forward_hook(after))

    def _backward_mark(self, name: str, call: int):
        def reached(grad: Any) -> None:
            self.record.mark("B", module=name, call=call)
        return reached

    def order(self, name: str) -> list[tuple[str, int]]:
        """The module's forwards and backwards, in the order they ran: ``[("F", 0), ("B", 0), ...]``."""
        return [(m.name, m.data["call"]) for m in self.record.marks
                if m.name in ("F", "B") and m.data.get("module") == name]

    # ------------------------------------------------------------ parameters
    def gradients(self, params: list[Any], name: str = "grad") -> None:
        """Mark ``name`` (with ``param=i``) each time parameter ``i``'s gradient is accumulated.

        Registered after the student's hooks, it runs after them: a mark tells a check
        what the student's hook for that parameter had done by then.
        """
        def ready(i: int):
            def hook(param: Any) -> None:     # a hook's return value would replace the gradient
                self.record.mark(name, param=i)
            return hook

        for i, param in enumerate(params):
            self.handles.append(param.register_post_accumulate_grad_hook(ready(i)))

    # ------------------------------------------------------------ activations
    def _release(self, key: tuple[str, int] | None) -> None:
        if key is None:
            return
        self.live[key] -= 1
        if self.live[key] == 0:
            del self.live[key]
            self.record.mark("released", module=key[0], call=key[1], held=self._held())

    def _held(self) -> int:
        return len(self.live)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Count, per watched call, the tensors autograd saves for backward in the block."""
        import torch

        def pack(tensor: Any) -> Any:
            saved = _Saved(tensor)
            key = self._running[-1] if self._running else None
            if key is None:
                self.stray += 1
            else:
                before = self._held()
                self.live[key] = self.live.get(key, 0) + 1
                if self._held() > before:
                    self.peak = max(self.peak, self._held())
                    self.record.mark("held", module=key[0], call=key[1], held=self._held())
            weakref.finalize(saved, self._release, key)
            return saved

        def unpack(saved: _Saved) -> Any:
            return saved.tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def remove(self) -> None:
        """Take every hook off (the modules and parameters are the checker's, but tidy is cheap)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

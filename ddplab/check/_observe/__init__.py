"""What a check observes for itself, on the ranks, instead of trusting what the student's code reports.

- ``wire``: every collective and point-to-point op this rank's process groups
  carried out during a block, seen below ``torch.distributed``'s names (the c10d
  dispatcher, the backend's methods), with the checker's own marks in the same
  sequence (``record``), each collective confirmed by torch's flight recorder
  (``confirm``).
- ``schedule``: forward and backward of the checker's own modules, gradients
  ready on its own parameters, and the activations autograd holds, from hooks the
  checker installs: never from a list the student's object keeps.
- ``overlap``: questions about the two together: which ops started inside
  backward, which were still pending when backward went on to the next gradient
  or when it ended, and ``pace``, which makes "pending" exact on a machine where a
  tiny all_reduce finishes in microseconds.

``wire``, ``schedule`` and ``overlap`` end their docstrings with how a checker
uses them. Checkers run them on the ranks, inside the function that calls the
student's code, and return plain data (``Record.plain``, ``overlap.facts``,
``Watch.order``) for the kernel to judge.
"""

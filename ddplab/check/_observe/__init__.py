"""What a check observes for itself, on the ranks, instead of trusting what the student's code reports.

- ``wire``: every collective and point-to-point op this rank's process groups
  carried out during a block, seen below ``torch.distributed``'s names (the c10d
  dispatcher, the backend's methods, torch's flight recorder), with the
  checker's own marks in the same sequence.
- ``schedule``: forward and backward of the checker's own modules, gradients
  ready on its own parameters, and the activations autograd holds, from hooks the
  checker installs: never from a list the student's object keeps.
- ``overlap``: questions about the two together: which ops started inside
  backward, which were still pending when the next gradient was ready or when
  backward ended, and a late rank that makes "pending" mean something on a
  machine where a tiny all_reduce finishes in microseconds.

Each module's docstring ends with how a checker uses it.
"""

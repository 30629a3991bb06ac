"""``python -m ddplab`` is the ``ddplab`` command (doctor, release, grade, notebooks, autograder)."""

from ddplab.course.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

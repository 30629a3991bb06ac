"""``python -m ddplab`` is the ``ddplab`` command (doctor, release, grade)."""

from ddplab.course.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

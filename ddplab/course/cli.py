"""The ``ddplab`` command.

    ddplab doctor                                  # can this machine run a lab?
    ddplab release notebooks/ -o release/          # student versions: solutions become stubs
    ddplab grade submitted/ --reference notebooks/ --csv grades.csv --junit grades.xml
    ddplab notebooks course/ [--reference]        # the shipped notebooks: student (or reference) versions
    ddplab autograder notebooks/06_x.ipynb -o autograder.zip   # Gradescope's autograder for an assignment
    ddplab remove-solutions                       # a graded term: this installation keeps no solutions
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from ..text import plural


def doctor() -> int:
    """Print torch, backends and GPUs, then start and stop a 2-rank lab as a self-test."""
    import torch
    import torch.distributed as dist

    import ddplab
    from ddplab.env import gpu_count

    print(f"python      {sys.version.split()[0]}")
    print(f"torch       {torch.__version__}")
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()),
                                      ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    print(f"backends    {', '.join(backends) or 'none'}")
    gpus = gpu_count()
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    print(f"GPUs        {gpus}" + (f" ({', '.join(names)})" if names else ""))
    print("self-test   starting a 2-rank lab ...", flush=True)
    begin = time.perf_counter()
    try:
        with ddplab.start(world_size=2, timeout=60) as lab:
            sums = lab.run(_all_reduce_rank)
            started = time.perf_counter() - begin
        assert sums == [1.0, 1.0], f"all_reduce gave {sums}, expected [1.0, 1.0]"
    except Exception as exc:
        print(f"self-test   FAILED: {exc}")
        return 1
    print(f"self-test   ok: 2 ranks, backend {lab.backend}, all_reduce correct, "
          f"{started:.1f} s, stopped cleanly")
    return 0


def _all_reduce_rank() -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddplab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check torch, backends and GPUs, and self-test a 2-rank lab")
    rel = sub.add_parser("release", help="write student versions: solution blocks become stubs")
    rel.add_argument("notebooks", nargs="+", help="course notebooks, or folders of them")
    rel.add_argument("-o", "--output", required=True, help="folder for the student versions")
    gr = sub.add_parser("grade", help="grade submitted notebooks against the reference outputs")
    gr.add_argument("submissions", nargs="+", help="submitted notebooks, or folders of them")
    gr.add_argument("--reference", default=None,
                    help="the course's notebooks folder (matched by file name), or one notebook "
                         "(default: the notebooks that ship with ddplab)")
    gr.add_argument("--jobs", type=int, default=None,
                    help="submissions graded at once (default: four per core, as memory allows)")
    gr.add_argument("--cell-timeout", type=float, default=None,
                    help="seconds a cell may run before it is stopped (default 120)")
    gr.add_argument("--csv", help="also write the grades as CSV to this file")
    gr.add_argument("--junit", help="also write JUnit XML (one test case per exercise) to this file")
    gr.add_argument("--gradescope", help="also write Gradescope's results.json (one student's "
                                         "submission; rewritten as each notebook finishes)")
    gr.add_argument("--canvas", help="also write a gradebook CSV that Canvas imports (a column of "
                                     "points per notebook)")
    gr.add_argument("--roster", metavar="CSV",
                    help="for --canvas: Canvas's gradebook export (Grades > Export); each hand-in "
                         "folder is matched to its student's ID, SIS User ID, SIS Login ID and section")
    gr.add_argument("--student-depth", type=int, default=None, metavar="N",
                    help="the student is the folder N deep under each folder named (1: "
                         "submitted/alice/..., 2: class/sec1/alice/..., 0: the folder named is one "
                         "student's); default: the folder that holds the shallowest notebooks")
    gr.add_argument("--run-as", metavar="USER",
                    help="where there is no sandbox (bubblewrap), run each submission as USER, a "
                         "user without rights (the grader runs as root): Gradescope's container")
    gr.add_argument("--resume", action="store_true",
                    help="keep the results an interrupted run with the same --csv/--junit "
                         "journalled, and grade only the submissions it had not finished")
    nbs = sub.add_parser("notebooks", help="copy the course notebooks that ship with ddplab; "
                                           "notebooks already in DEST are kept, never overwritten")
    nbs.add_argument("dest", help="folder to copy them into")
    nbs.add_argument("--reference", action="store_true",
                     help="the reference versions, solutions in (default: the student versions)")
    sub.add_parser("remove-solutions", help="for a graded term: the notebooks this installed ddplab "
                                            "carries become their student versions (hints kept)")
    ag = sub.add_parser("autograder", help="build the zip Gradescope runs to grade an assignment "
                                           "with ddplab grade")
    ag.add_argument("notebooks", nargs="+", help="the assignment's reference notebooks")
    ag.add_argument("-o", "--output", required=True, help="the zip to write (autograder.zip)")
    ag.add_argument("--cell-timeout", type=float, default=None,
                    help="seconds a cell may run before it is stopped (default 120)")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    if args.command == "release":
        return release(args)
    if args.command == "grade":
        return grade(args)
    if args.command == "notebooks":
        return notebooks(args)
    if args.command == "autograder":
        return autograder(args)
    if args.command == "remove-solutions":
        return remove_solutions()
    return 2


def autograder(args) -> int:
    """Write Gradescope's autograder zip; exit 2 with the reason if a reference is unfit."""
    from ddplab.course.autograder import build
    from ddplab.errors import CourseError, GradeError
    from ddplab.grade.class_run import DEFAULT_CELL_TIMEOUT
    from ddplab.grade.compare import require_nbval
    from ddplab.grade.journal import positive

    try:
        require_nbval("autograder")
        timeout = positive("--cell-timeout", args.cell_timeout, DEFAULT_CELL_TIMEOUT,
                           f"the default, {DEFAULT_CELL_TIMEOUT:g} s")
        path = build(args.notebooks, args.output, cell_timeout=timeout)
    except (CourseError, GradeError) as e:
        print(e, file=sys.stderr)
        return 2
    print(f"wrote {path}: upload it as the assignment's autograder on Gradescope "
          f"(Ubuntu 24.04 base image); students hand in {', '.join(Path(n).name for n in args.notebooks)}")
    return 0


def notebooks(args) -> int:
    """Copy the shipped notebooks into args.dest, keeping any already there."""
    from ddplab.course.notebooks import copy_notebooks
    from ddplab.errors import CourseError

    try:
        written, kept, refused = copy_notebooks(args.dest, reference=args.reference)
    except CourseError as e:
        print(e, file=sys.stderr)
        return 2
    kind = "reference" if args.reference else "student"
    for path in written:
        print(f"copied {path} ({kind} version)")
    for path in kept:
        print(f"kept   {path} (already there: never overwritten)")
    for line in refused:
        print(f"ddplab notebooks: not copied: {line}", file=sys.stderr)
    return 1 if refused else 0


def remove_solutions() -> int:
    """Make this installation solution-free; exit 2 with the reason where it cannot be."""
    from ddplab.course.notebooks import remove_solutions as remove
    from ddplab.errors import CourseError, ReleaseError

    try:
        rewritten = remove()
    except (CourseError, ReleaseError, OSError) as e:
        print(e, file=sys.stderr)
        return 2
    for path in rewritten:
        print(f"student version {path}")
    print("this installation carries no solutions now (ddplab.solution and ddplab notebooks "
          "--reference say so; ddplab.hint still helps)")
    return 0


def release(args) -> int:
    """Write the student version of each notebook; exit 2 with the reason if one is unfit."""
    from ddplab.course.release import ReleaseError, release as write

    try:
        written = write(args.notebooks, args.output)
    except (ReleaseError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    for path in written:
        print(f"released {path}")
    return 0


def _one_student(submissions: list[str], reference: str, depth: int | None) -> None:
    """Gradescope runs its autograder once per student: --gradescope grades one student's work."""
    from ddplab.grade.class_run import GradeError
    from ddplab.grade.handin import handed_in
    from ddplab.grade.plan import notebooks_in

    names = {p.name for p in notebooks_in([reference])} if Path(reference).exists() else set()
    students = sorted({"/".join(filter(None, (h.section, h.student)))
                       for h in handed_in(submissions, names, depth)})
    if len(students) > 1:
        raise GradeError(f"ddplab grade: --gradescope writes one student's results (Gradescope runs "
                         f"the autograder once per submission), but these are the work of "
                         f"{len(students)} students ({', '.join(students[:3])}...). Grade one "
                         f"student's notebooks, or use --csv / --canvas for a class.")


def _terminated(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def grade(args) -> int:
    """Grade, print the table, write CSV/JUnit; exit 0 if every exercise passed, else 1."""
    from ddplab.grade import gradebook, report, unprivileged
    from ddplab.grade.class_run import DEFAULT_CELL_TIMEOUT, GradeError, grade as run
    from ddplab.grade.compare import require_nbval
    from ddplab.grade.journal import journal_for, positive, writable, write_atomically

    try:
        require_nbval("grade")
    except GradeError as e:
        print(e, file=sys.stderr)
        return 2
    finished, lock = [], threading.Lock()

    def progress(g) -> None:
        done = g.error or f"{g.score}/{len(g.marks)} in {g.seconds:.0f} s"
        who = f"{g.section}/{g.student}" if g.section else g.student
        print(f"graded {who} ({g.notebook}): {done}", file=sys.stderr, flush=True)
        if args.gradescope:              # as grading goes: a run stopped by a time limit still says
            with lock:
                finished.append(g)
                write_atomically(args.gradescope, report.to_gradescope(finished))

    if args.reference is None:
        from ddplab.course.notebooks import CourseError, reference_dir, refuse_if_removed
        try:
            refuse_if_removed("ddplab grade without --reference")
        except CourseError as e:
            print(e, file=sys.stderr)
            return 2
        args.reference = str(reference_dir())
    try:
        # Every mistake in the command line is found now, not after the class was graded.
        timeout = positive("--cell-timeout", args.cell_timeout, DEFAULT_CELL_TIMEOUT,
                           f"the default, {DEFAULT_CELL_TIMEOUT:g} s")
        jobs = positive("--jobs", args.jobs, None, "four per core, as memory allows")
        inputs = [*args.submissions, args.reference]
        outputs = [(option, path) for option, path in
                   (("--csv", args.csv), ("--junit", args.junit), ("--gradescope", args.gradescope),
                    ("--canvas", args.canvas)) if path]
        targets = [writable(option, path, inputs) for option, path in outputs]
        for (first, path), target in zip(outputs, targets):
            same = [option for (option, _), other in zip(outputs, targets)
                    if option != first and other.resolve() == target.resolve()]
            if same:
                raise GradeError(f"ddplab grade: {first} and {same[0]} both name {path}: one would "
                                 f"replace the other. Name a file for each.")
        if args.student_depth is not None and args.student_depth < 0:
            raise GradeError(f"ddplab grade: --student-depth {args.student_depth} is negative; it "
                             f"counts folders under each folder named (0: the folder is one student's).")
        if args.roster and not args.canvas:
            raise GradeError("ddplab grade: --roster is for --canvas (it fills the Canvas file's ID "
                             "columns). Add --canvas grades.csv, or leave out --roster.")
        roster = gradebook.Roster.read(args.roster) if args.roster else None
        if args.gradescope:
            _one_student(args.submissions, args.reference, args.student_depth)
        run_as = unprivileged.account(args.run_as) if args.run_as else None
        journal = journal_for(targets, resume=args.resume)
    except (GradeError, FileNotFoundError) as e:   # ordinary mistakes: one line, exit 2
        print(e, file=sys.stderr)
        return 2
    from ddplab import procs
    from ddplab.grade import sandbox
    # Whatever a worker leaves when a submission kills it comes to us, not to
    # init, and is ended before we exit.
    procs.become_subreaper()
    unsafe = sandbox.unavailable_reason()
    if unsafe and run_as:
        print(f"ddplab grade: grading without a sandbox ({unsafe}): each submission runs as "
              f"{run_as.name} (--run-as), and can read what every user of this machine can.",
              file=sys.stderr, flush=True)
    elif unsafe:
        print(f"ddplab grade: grading WITHOUT a sandbox ({unsafe}): submissions run with your "
              f"rights and can read your files and find this process.", file=sys.stderr, flush=True)
    begin = time.perf_counter()
    # SIGTERM (a job's time limit, `kill`) stops grading as Ctrl-C does: the workers end and their
    # work folders go; what finished is in the journal for --resume, and nothing else is.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        grades = run(args.submissions, args.reference, jobs=jobs, cell_timeout=timeout,
                     progress=progress, journal=journal, run_as=run_as,
                     student_depth=args.student_depth)
    except (GradeError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    finally:
        procs.end_descendants(grace=1)
    if args.gradescope:
        write_atomically(args.gradescope, report.to_gradescope(grades))
    if args.canvas:
        write_atomically(args.canvas, report.to_canvas(grades, roster))
        for line in gradebook.roster_warnings(grades, roster) if roster else []:
            print(f"ddplab grade: --canvas: {line}", file=sys.stderr)
    print(report.table(grades), end="")
    took = time.perf_counter() - begin
    print(f"\n{len(grades)} {plural(len(grades), 'submission')} graded in {took:.0f} s")
    if args.csv:
        write_atomically(args.csv, report.to_csv(grades))
    if args.junit:
        write_atomically(args.junit, report.to_junit(grades))
    if journal is not None:
        journal.finish()
    return 0 if all(not g.error and g.score == len(g.marks) for g in grades) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The student transformer: built from core/arch.py's builders or a config.json (student/model.py).

`wandistiller.student.Student` and `build_student` (documented names) are looked up on first use."""


def __getattr__(name: str):
    if name in ("Student", "build_student", "student_config"):
        from wandistiller.student import model  # noqa: PLC0415 -- on first use, as said above

        return getattr(model, name)
    raise AttributeError(f"module 'wandistiller.student' has no attribute {name!r}")

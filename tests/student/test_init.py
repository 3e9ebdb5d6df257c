"""wandistiller/student/__init__.py: the documented names `Student`, `build_student`, `student_config`."""

from __future__ import annotations

import pytest

import wandistiller.student
from wandistiller.student import model


@pytest.mark.parametrize("name", ["Student", "build_student", "student_config"])
def test_each_documented_name_is_the_one_in_student_model(name):
    assert getattr(wandistiller.student, name) is getattr(model, name)


def test_any_other_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="has no attribute 'Teacher'"):
        wandistiller.student.Teacher  # noqa: B018

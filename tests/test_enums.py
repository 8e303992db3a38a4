"""The enumerations of UForm 4's trainer API: member names, integer values, words, and how parsing refuses bad input."""

from __future__ import annotations

import enum

import pytest

from uform.enums import LateInteractionSide, Modality, Negatives, Objective, PairLossForm, Scalar

# The reference API's members, in its order, with its integer values (LateInteractionSide's `None` is `None_`).
REFERENCE_MEMBERS = {
    Modality: [("Text", 0), ("Image", 1), ("Video", 2), ("Audio", 3)],
    Objective: [("Masked", 0), ("Contrastive", 1), ("Joint", 2)],
    Negatives: [("Ambient", 0), ("Named", 1)],
    PairLossForm: [("Derived", 0), ("Balanced", 1), ("Ranked", 2), ("Sigmoid", 3)],
    LateInteractionSide: [("None_", 0), ("Query", 1), ("Document", 2), ("QueryAndDocument", 3)],
}

# The words each member prints as and parses from.
REFERENCE_WORDS = {
    Modality: ["text", "image", "video", "audio"],
    Objective: ["masked", "contrastive", "joint"],
    Negatives: ["ambient", "named"],
    PairLossForm: ["derived", "balanced", "ranked", "sigmoid"],
    LateInteractionSide: ["none", "query", "document", "queryanddocument"],
}

ALL_ENUMS = [*REFERENCE_MEMBERS, Scalar]


def _ids(kinds):
    return [kind.__name__ for kind in kinds]


# --------------------------------------------------------------------------------------------------
# Names and values


@pytest.mark.parametrize("kind", list(REFERENCE_MEMBERS), ids=_ids(REFERENCE_MEMBERS))
def test_members_match_the_reference_exactly(kind):
    assert [(m.name, m.value) for m in kind] == REFERENCE_MEMBERS[kind]
    # No aliases hiding behind the listed members.
    assert list(kind.__members__) == [name for name, _ in REFERENCE_MEMBERS[kind]]


@pytest.mark.parametrize("kind", list(REFERENCE_MEMBERS), ids=_ids(REFERENCE_MEMBERS))
def test_members_are_integers(kind):
    for name, value in REFERENCE_MEMBERS[kind]:
        member = kind[name]
        assert isinstance(member, int)
        assert member == value
        assert int(member) == value
        assert kind(value) is member


def test_named_values_from_the_design():
    assert Modality.Text == 0
    assert Modality.Audio == 3
    assert Objective.Joint == 2
    assert PairLossForm.Sigmoid == 3
    assert LateInteractionSide.None_ == 0
    assert LateInteractionSide.QueryAndDocument == 3


# --------------------------------------------------------------------------------------------------
# Words: print and parse


def test_examples_from_the_design():
    assert str(Objective.Joint) == "joint"
    assert Modality.parse("image") is Modality.Image


@pytest.mark.parametrize("kind", list(REFERENCE_WORDS), ids=_ids(REFERENCE_WORDS))
def test_members_print_as_their_words(kind):
    assert [str(m) for m in kind] == REFERENCE_WORDS[kind]
    assert [f"{m}" for m in kind] == REFERENCE_WORDS[kind]
    assert [format(m) for m in kind] == REFERENCE_WORDS[kind]
    assert kind.words() == REFERENCE_WORDS[kind]


@pytest.mark.parametrize("kind", list(REFERENCE_WORDS), ids=_ids(REFERENCE_WORDS))
def test_members_parse_from_their_words(kind):
    for member, word in zip(kind, REFERENCE_WORDS[kind], strict=True):
        assert kind.parse(word) is member
        assert kind.parse(word.upper()) is member
        assert kind.parse(f"  {word}\n") is member


@pytest.mark.parametrize("kind", ALL_ENUMS, ids=_ids(ALL_ENUMS))
def test_print_then_parse_round_trips(kind):
    for member in kind:
        word = str(member)
        assert word == word.lower()
        assert kind.parse(word) is member


def test_late_interaction_side_none_is_the_word_none():
    assert str(LateInteractionSide.None_) == "none"
    assert LateInteractionSide.parse("none") is LateInteractionSide.None_
    assert LateInteractionSide.parse("None") is LateInteractionSide.None_
    assert "none" in LateInteractionSide.words()
    # "none" is LateInteractionSide's word alone.
    with pytest.raises(ValueError):
        Modality.parse("none")


@pytest.mark.parametrize("kind", ALL_ENUMS, ids=_ids(ALL_ENUMS))
def test_parse_accepts_members_and_integer_values(kind):
    for member in kind:
        assert kind.parse(member) is member
        assert kind.parse(int(member)) is member


# --------------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    ("kind", "word"),
    [
        pytest.param(Modality, "smell", id="Modality-smell"),
        pytest.param(Modality, "", id="Modality-empty"),
        pytest.param(Objective, "both", id="Objective-both"),
        pytest.param(Negatives, "hard", id="Negatives-hard"),
        pytest.param(PairLossForm, "softmax", id="PairLossForm-softmax"),
        pytest.param(LateInteractionSide, "both", id="LateInteractionSide-both"),
        pytest.param(Scalar, "f64", id="Scalar-f64"),
    ],
)
def test_unknown_word_raises_value_error_naming_the_field(kind, word):
    with pytest.raises(ValueError, match="the_field"):
        kind.parse(word, "the_field")
    # Without a field, the enum's own name stands in for it.
    with pytest.raises(ValueError, match=kind.__name__):
        kind.parse(word)


@pytest.mark.parametrize("kind", list(REFERENCE_MEMBERS), ids=_ids(REFERENCE_MEMBERS))
def test_out_of_range_integer_raises_value_error_naming_the_field(kind):
    for value in (-1, len(kind), 99):
        with pytest.raises(ValueError, match="the_field"):
            kind.parse(value, "the_field")


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(1.0, id="float"),
        pytest.param(True, id="bool"),
        pytest.param(None, id="None"),
        pytest.param(b"image", id="bytes"),
        pytest.param(["image"], id="list"),
    ],
)
@pytest.mark.parametrize("kind", list(REFERENCE_MEMBERS), ids=_ids(REFERENCE_MEMBERS))
def test_wrong_type_raises_type_error_naming_the_field(kind, value):
    with pytest.raises(TypeError, match="the_field"):
        kind.parse(value, "the_field")


@pytest.mark.parametrize(
    ("kind", "other"),
    [
        pytest.param(Modality, PairLossForm.Sigmoid, id="Modality<-PairLossForm"),
        pytest.param(Objective, Modality.Image, id="Objective<-Modality"),
        pytest.param(PairLossForm, LateInteractionSide.Query, id="PairLossForm<-LateInteractionSide"),
    ],
)
def test_another_enums_member_raises_type_error(kind, other):
    with pytest.raises(TypeError, match="the_field"):
        kind.parse(other, "the_field")


def test_enums_are_int_enums():
    for kind in ALL_ENUMS:
        assert issubclass(kind, enum.IntEnum)

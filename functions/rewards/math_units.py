"""Units in math answers: the unit words stripped from an answer (``_UNIT_TOKEN``), the units
an answer carries (``unit_key``) and the unit the prose states right after an answer
(``unit_after``). The canonical form (``functions.rewards.math_canonical``) strips what these
recognise; the rules are documented in ``functions.rewards.math``."""

from __future__ import annotations

import re

from functions.rewards.math_cache import _small_cache
from functions.rewards.math_unicode import plain_unicode

_UNITS = (
    "mm cm km meter meters metre metres centimeter centimeters millimeter millimeters kilometer "
    "kilometers in inch inches ft foot feet yd yard yards mi mile miles mph kph kmh "
    "kg mg gram grams kilogram kilograms lb lbs pound pounds oz ounce ounces ton tons "
    "ml liter liters litre litres gallon gallons cup cups quart quarts "
    "sec second seconds min minute minutes hr hrs hour hours day days week weeks month months "
    "year years dollar dollars cent cents euro euros "
    "deg degree degrees radian radians unit units sq square cubic "
    "people persons students apples cookies marbles pages points ways times "
    "m/s km/h ft/s mi/h per sqft "
    "boys girls children adults men women friends members players teams games books cards coins "
    "balls boxes bags eggs trees dogs cats cars rows seats handshakes hats tickets toys"
).split()
# one-letter units are units only inside ``\text{}``/``\mathrm{}``: bare, they are variables
# (``\frac{1}{2} b h``, ``4 s``, ``2 \pi r h``)
_LETTER_UNITS = "m s h g l".split()


def _unit_token(units: list[str]) -> re.Pattern[str]:
    """One unit token (``cm``, ``m^2``, ``km²``, ``sec.``). Units are stripped token by token
    from the right (``_strip_units``), never with a pattern anchored at ``$`` that is retried
    from every start, which is quadratic in a long run of spaces or units."""
    return re.compile(
        r"(?:" + "|".join(sorted(units, key=len, reverse=True)) + r")\.?(?:\^\{?[23]\}?|²|³)?",
        re.IGNORECASE,
    )


_UNIT_TOKEN = _unit_token(_UNITS)
_TEXT_UNIT_TOKEN = _unit_token(_UNITS + _LETTER_UNITS)
# degrees: a unit (``unit_key``), which the canonical form strips too
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°|\\degree\b")

# what a unit word names, so that two answers that both carry a unit are compared with it
# (5 hours is not 5 minutes, nor 5 km 5 miles: both were 5); the scale is not converted (5 km
# is not 5000 m either). Count nouns (apples, people) name no unit and are left out, as is
# "in", also a word of prose
_UNIT_NAMES: dict[str, tuple[str, ...]] = {}
for _key, _names in {
    "mm": "mm millimeter millimeters millimetre millimetres",
    "cm": "cm centimeter centimeters centimetre centimetres",
    "m": "m meter meters metre metres",
    "km": "km kilometer kilometers kilometre kilometres",
    "inch": "inch inches",
    "ft": "ft foot feet",
    "yd": "yd yard yards",
    "mi": "mi mile miles",
    "mg": "mg milligram milligrams",
    "g": "g gram grams",
    "kg": "kg kilogram kilograms",
    "lb": "lb lbs pound pounds",
    "oz": "oz ounce ounces",
    "ton": "ton tons",
    "ml": "ml milliliter milliliters millilitre millilitres",
    "l": "l liter liters litre litres",
    "gal": "gallon gallons",
    "cup": "cup cups",
    "quart": "quart quarts",
    "s": "s sec secs second seconds",
    "min": "min mins minute minutes",
    "h": "h hr hrs hour hours",
    "day": "day days",
    "week": "week weeks",
    "month": "month months",
    "year": "year years",
    "dollar": "dollar dollars",
    "cent": "cent cents",
    "euro": "euro euros",
    "deg": "deg degree degrees",
    "rad": "rad radian radians",
    "^2": "sq square",
    "^3": "cubic",
}.items():
    _UNIT_NAMES.update(dict.fromkeys(_names.split(), (_key,)))
_UNIT_NAMES |= {"mph": ("mi", "h"), "kph": ("km", "h"), "kmh": ("km", "h"), "sqft": ("^2", "ft")}
_UNIT_SCAN = re.compile(
    r"\\(?:text|textrm|mathrm|mbox|operatorname)\s*\{([^{}]*)\}(\s*\^\s*\{?[23]\}?)?"
    r"|\\[A-Za-z]+"
    r"|([A-Za-z]+(?:/[A-Za-z]+)?)(\s*\^\s*\{?[23]\}?)?"
)
_UNIT_WORD = re.compile(r"[A-Za-z]+(?:/[A-Za-z]+)?")
_LETTER = re.compile(r"[A-Za-z°]")


def _unit_names(word: str, bare: bool) -> list[str]:
    """The units ``word`` names (``km/h``: km and h; ``meters``: m), none for a word that names
    none or, ``bare`` (outside ``\\text{}``), a lone letter: a variable there."""
    out: list[str] = []
    for part in word.lower().split("/"):
        if bare and "/" not in word and len(part) < 2:
            return []
        out += _UNIT_NAMES.get(part, ())
    return out


@_small_cache
def unit_key(answer: str) -> tuple[str, ...]:
    """The units an answer carries, sorted (``12 \\text{ ft}^2`` and ``12 square feet``:
    ``("^2", "ft")``; ``30^\\circ``: ``("deg",)``); empty when it carries none (a power
    alone, ``x^2``, is no unit)."""
    if not _LETTER.search(answer):
        return ()
    s = plain_unicode(answer)
    found: list[str] = ["deg"] if _DEGREES.search(s) else []
    for m in _UNIT_SCAN.finditer(s):
        if m[1] is not None:
            words = [u for w in _UNIT_WORD.findall(m[1]) for u in _unit_names(w, bare=False)]
            power = m[2]
        elif m[3] is not None:
            words, power = _unit_names(m[3], bare=True), m[4]
        else:
            continue
        found += words
        if words and power:
            found.append("^3" if "3" in power else "^2")
    if not any(u[0] != "^" for u in found):  # "square" alone names no unit
        return ()
    return tuple(sorted(found))


# what may follow an answer read out of prose before its unit: spaces, a math span's closing
# $ (``$5$ hours``); then a \text{} group, or a few words on the same line
_BEFORE_UNIT = re.compile(r"[ \t]*+(?:\$[ \t]*+)?")
_UNIT_GROUP = re.compile(
    r"\\(?:text|textrm|mathrm|mbox)[ \t]*\{([^{}\n]{1,60})\}(?:[ \t]*\^[ \t]*\{?[23]\}?)?"
)
_PROSE_WORD = re.compile(r"[ \t]*+([^\s$]{1,30})")
_SPAN_POWER = re.compile(r"\$\^\{?([23])\}?\$")  # a unit's power in math of its own: cm$^2$
_UNIT_AFTER_WORDS = 4  # "square feet", "miles per hour", "meters per second squared"
_WORD_END = ".,;:!?)"


def unit_after(text: str, pos: int) -> str:
    """The unit the prose states right after an answer that ends at ``pos`` (" hours" in "It
    takes 5 hours."; "\\text{ hours}"; " miles per hour"), with the space before it, or ``""``
    when the words there name no unit (``unit_key``: "5 apples", "5 in the box"). Reads a few
    words at most: bounded, however long the text."""
    at = _BEFORE_UNIT.match(text, pos)
    start = at.end() if at else pos
    if group := _UNIT_GROUP.match(text, start):
        words = group[1].split()
        if words and all(_TEXT_UNIT_TOKEN.fullmatch(w) for w in words):
            return " " + group[0] if unit_key(group[0]) else ""
        return ""
    end = start
    for _ in range(_UNIT_AFTER_WORDS):
        word = _PROSE_WORD.match(text, end)
        if word is None:
            break
        bare = word[1].rstrip(_WORD_END)
        if not bare or bare.lower() == "in" or not _UNIT_TOKEN.fullmatch(bare):
            break
        end = word.start(1) + len(bare)
        if bare != word[1]:  # punctuation ends the phrase ("5 hours, door to door")
            break
    unit = text[start:end]
    if unit and (power := _SPAN_POWER.match(text, end)):  # cm$^2$
        unit += "^" + power[1]
    return " " + unit if unit and unit_key(unit) else ""

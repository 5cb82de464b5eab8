import pytest

from kvray.sizes import format_size, parse_size

GIB = 1 << 30


@pytest.mark.parametrize(
    "text", ["1GB", "1024MB", "1048576KB", "1073741824B", "1073741824", "1gb", " 1 GB ", "1.0GB"]
)
def test_one_gib_spellings(text):
    assert parse_size(text) == GIB


def test_int_and_fraction():
    assert parse_size(GIB) == GIB
    assert parse_size("1.5GB") == 3 * GIB // 2
    assert parse_size("2TB") == 2 << 40
    assert parse_size(0) == 0


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("10G", "cannot parse size"),
        ("1GiB", "cannot parse size"),
        ("-1GB", "cannot parse size"),
        ("abc", "cannot parse size"),
        ("", "cannot parse size"),
        ("1.3B", "whole number of bytes"),
        (-5, ">= 0"),
        (True, "expected a size"),
        (1.5, "expected a size"),
    ],
)
def test_bad_sizes_name_field(value, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        parse_size(value, field="global_segment_size")
    assert "global_segment_size" in str(info.value)


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(GIB) == "1.0 GiB"

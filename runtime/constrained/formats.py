"""Exact grammars for the string formats the backends enforce only approximately.

Measured against jsonschema's own format checker (tests/test_structured.py): xgrammar's and
llguidance's `date` admit 2021-02-29, 1900-02-29 and year 0000 (xgrammar also 2021-04-31), their
`time` and `date-time` a 60th second, xgrammar's `ipv4` leading zeros and its `hostname` labels
over 63 characters, llguidance's `hostname` names over 253. Such a format is replaced in the
schema by one of these patterns, each written to admit only values the checker accepts
(calendar days and leap years included); a backend that cannot take a pattern with lengths
beside it (xgrammar) refuses the formats that need both.
"""

from __future__ import annotations

_D = "[0-9]"
_YEAR = f"(?:{_D}{{3}}[1-9]|{_D}{{2}}[1-9]{_D}|{_D}[1-9]{_D}{{2}}|[1-9]{_D}{{3}})"  # 0001-9999
# years divisible by 4 but not 100, or by 400 (0000 is no year)
_LEAP_YEAR = f"(?:{_D}{{2}}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
              "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              "|02-(?:0[1-9]|1[0-9]|2[0-8]))")
DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
# RFC 3339 as jsonschema checks it (rfc3339-validator): no leap second, any case for T and Z
TIME = ("(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?"
        "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
DATE_TIME = f"{DATE}[Tt]{TIME}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"  # no leading zeros (ipaddress refuses them)
IPV4 = f"{_OCTET}(?:\\.{_OCTET}){{3}}"
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = f"{_LABEL}(?:\\.{_LABEL})*\\.?"  # with maxLength 253 (the whole name)
HOSTNAME_MAX_LENGTH = 253

# format -> (pattern, the maxLength it also needs, or None)
EXACT = {
    "date": (DATE, None),
    "time": (TIME, None),
    "date-time": (DATE_TIME, None),
    "ipv4": (IPV4, None),
    "hostname": (HOSTNAME, HOSTNAME_MAX_LENGTH),
}

# Narrowings (schema_policy.py): formats no backend enforces, replaced by a pattern that admits only a
# part of them (each value it admits passes the checker: tests/test_structured.py)
NARROWER = {
    "regex": "[A-Za-z0-9 _-]*",  # text with no special characters: a regex matching itself
    "uri-reference": "[A-Za-z0-9._~/-]*",  # a relative path
    "iri-reference": "[A-Za-z0-9._~/-]*",
    # lower-case letters and digits, at most three labels (well under 253): `idna` refuses upper case, and a
    # hyphen could make an `xn--` label that is not valid punycode (a plain hostname's pattern admits "xn--X")
    "idn-hostname": "[a-z0-9]{1,63}(?:\\.[a-z0-9]{1,63}){0,2}",
}
# ... or by a format they include: every URI is an IRI, every e-mail address an internationalised one
SUBFORMAT = {"iri": "uri", "idn-email": "email"}

# OpenAPI's formats of integers and numbers, enforced as the ranges of their machine types (schema_policy.py)
NUMBER_FORMATS = {
    "int8": (-2**7, 2**7 - 1), "int16": (-2**15, 2**15 - 1), "int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1),
    "uint8": (0, 2**8 - 1), "uint16": (0, 2**16 - 1), "uint32": (0, 2**32 - 1), "uint64": (0, 2**64 - 1),
    "float": (-3.4028234663852886e38, 3.4028234663852886e38),
    "double": (-1.7976931348623157e308, 1.7976931348623157e308),
}
# formats OpenAPI and common generators write as annotations (no validator asserts them): ignored without a note
KNOWN_ANNOTATIONS = {"binary", "byte", "password", "textarea", "color", "markdown", "html", "base64", "text"}

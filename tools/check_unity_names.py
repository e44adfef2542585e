#!/usr/bin/env python3
"""Refuse what a unity build would silently change (Note [Unity builds of the
LibTorch targets], cmake/StrataTorchPch.cmake).

A unity batch is one translation unit, so everything one of its files declares
at file scope is seen by the files after it. A clash of two classes, two
variables or two functions of one signature is a compile error; these are not:

  - two file-local functions (anonymous namespace, or `static` at namespace
    scope) of one name in two files of a target: with other parameter types
    they form one overload set, and a call in one file can pick the other's;
  - a using-directive (`using namespace x;`) at namespace scope: it reaches
    every later file of the batch;
  - a macro a .cpp file defines and does not #undef.

The check is per target, not per batch, because the batches change as files
are added. Usage: check_unity_names.py BUILD_DIR reads the file lists of the
unity targets from CMake's generated Unity/ sources; --files FILE... checks
the files given as one target. It exits 1 with one line per finding, or 0.
"""
import collections
import pathlib
import re
import sys


def strip(text):
    """The text with comments, string and character literals blanked (lines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "decltype", "alignof", "catch",
            "static_assert", "operator", "noexcept", "alignas", "requires"}


def function_name(statement):
    """The name a namespace-scope definition `statement {` defines, if it is a function."""
    s = " ".join(statement.split())
    if not s or re.match(r"(template\s*<.*>\s*)?(class|struct|union|enum|namespace|extern)\b", s):
        return None
    # The first '(' outside template arguments.
    depth = 0
    for k, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "=" and depth == 0:
            return None  # a variable (a lambda, a braced initialiser)
        elif ch == "(" and depth == 0:
            m = re.search(r"([A-Za-z_]\w*)\s*$", s[:k])
            if not m or m.group(1) in KEYWORDS or m.group(1).isupper() or "operator" in s[:k].split()[-1:]:
                return None
            return m.group(1)
    return None


def scan(path):
    """(file-local function names, using-directive lines, macros left defined) of one file."""
    text = strip(path.read_text())
    functions, usings, macros = set(), [], {}
    for lineno, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*#\s*define\s+(\w+)", line)
        if m:
            macros[m.group(1)] = lineno
        m = re.match(r"\s*#\s*undef\s+(\w+)", line)
        if m:
            macros.pop(m.group(1), None)
    # Preprocessor lines, a macro's continued lines with them, are no code here.
    code = re.sub(r"^\s*#(?:.*\\\n)*.*$", "", text, flags=re.M)
    stack, statement = [], []  # stack: 'anon', 'ns', 'block'
    for tok in re.finditer(r"[{};]|[^{};]+", code):
        t = tok.group(0)
        if t == "{":
            s = "".join(statement).strip()
            if re.fullmatch(r"(inline\s+)?namespace", s):
                stack.append("anon")
            elif re.fullmatch(r"(inline\s+)?namespace\s+[\w:]+|extern\s*\"\"", s):
                stack.append("ns")
            else:
                if all(k != "block" for k in stack):
                    name = function_name(s)
                    file_local = "anon" in stack or re.match(r"(template\s*<.*>\s*)?(static|inline static)\b", " ".join(s.split()))
                    if name and file_local:
                        functions.add(name)
                stack.append("block")
            statement = []
        elif t == "}":
            if stack:
                stack.pop()
            statement = []
        elif t == ";":
            s = " ".join("".join(statement).split())
            if all(k != "block" for k in stack) and re.match(r"using\s+namespace\b", s):
                usings.append(s)
            statement = []
        else:
            statement.append(t)
    return functions, usings, macros


def unity_targets(build_dir):
    """{target dir: [source files]} from CMake's generated unity sources."""
    # CMake leaves the batches of an earlier configuration in place: with
    # Ninja, only those build.ninja compiles are the build's.
    ninja = pathlib.Path(build_dir) / "build.ninja"
    built = ninja.read_text() if ninja.exists() else None
    targets = collections.defaultdict(list)
    for unity in sorted(pathlib.Path(build_dir).rglob("Unity/unity_*.cxx")):
        if built is not None and str(unity.absolute()) not in built and str(unity.resolve()) not in built:
            continue
        for m in re.finditer(r'#include\s+"([^"]+)"', unity.read_text()):
            targets[str(unity.parent.parent)].append(pathlib.Path(m.group(1)))
    return targets


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--files":
        targets = {"(the files given)": [pathlib.Path(f) for f in sys.argv[2:]]}
    elif len(sys.argv) == 2:
        targets = unity_targets(sys.argv[1])
    else:
        print("usage: check_unity_names.py BUILD_DIR | --files FILE...", file=sys.stderr)
        return 2
    if not targets:
        print(f"check_unity_names: no unity sources under {sys.argv[1]} (configured with STRATA_UNITY_BUILD=OFF?)")
        return 0
    findings = []
    for target, files in targets.items():
        if len(files) < 2:
            continue
        owners = collections.defaultdict(list)
        for f in files:
            functions, usings, macros = scan(f)
            for name in functions:
                owners[name].append(f)
            for u in usings:
                findings.append(f"{f}: '{u};' at namespace scope reaches the later files of its unity batch;"
                                " qualify the names or move it into the functions that use it")
            for name, lineno in macros.items():
                findings.append(f"{f}:{lineno}: macro {name} is not #undef'd at the end of the file;"
                                " it reaches the later files of its unity batch")
        for name, fs in sorted(owners.items()):
            if len(fs) > 1:
                findings.append(f"{pathlib.Path(target).name}: file-local function '{name}' is defined in "
                                f"{', '.join(str(f) for f in fs)}; in one unity batch they would overload each"
                                " other: rename one, or share one in a header")
    for line in findings:
        print(line)
    print(f"check_unity_names: {sum(len(v) for v in targets.values())} files in {len(targets)} unity targets, "
          f"{len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())

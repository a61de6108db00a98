#!/usr/bin/env python3
"""Rewrite README.md's deck table from the schema (`vitgrid help-deck`), or check it.

    tools/update_readme_deck.py [--check] [--bin build/bin/vitgrid] [--readme README.md]"""
import argparse
import os
import subprocess
import sys

BEGIN, END = "<!-- deck-reference:begin -->", "<!-- deck-reference:end -->"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="exit 1 if README differs from the schema")
    ap.add_argument("--bin", default=os.environ.get("VITGRID_BIN", "build/bin/vitgrid"))
    ap.add_argument("--readme", default=os.path.join(os.path.dirname(__file__), "..", "README.md"))
    a = ap.parse_args()
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    table = subprocess.run([a.bin, "help-deck"], capture_output=True, text=True, check=True, env=env).stdout.strip()
    text = open(a.readme).read()
    if BEGIN not in text or END not in text:
        sys.exit(f"{a.readme}: markers {BEGIN} / {END} not found")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + BEGIN + "\n" + table + "\n" + END + tail
    if a.check:
        if new != text:
            sys.exit("README.md's deck table differs from `vitgrid help-deck`: run tools/update_readme_deck.py")
        print("README deck table matches the schema")
        return
    open(a.readme, "w").write(new)
    print(f"updated {a.readme}")


if __name__ == "__main__":
    main()

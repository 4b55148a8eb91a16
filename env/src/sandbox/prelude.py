# Fathom sandbox prelude: runs once in a worker's embedded interpreter, before the seccomp
# filter is installed. It pre-imports the modules model code may use (nothing can be imported
# from disk afterwards), and defines `make_repl`, which builds one REPL session: the
# instrumented `context`, `llm`, an instrumented `re`, and the function that runs a cell with
# captured, size-limited output and Python-style tracebacks.
#
# Instrumentation: `context` is a `str` subclass (`Document`) whose slices remember their
# offset into the document. Slicing, the substring methods (`find`, `index`, `count`, `split`,
# `in`, ...) and the `re` functions record `(kind, argument, start, end)` tuples when applied to
# the document or a slice of it. The records are advisory: code that wants to hide its accesses
# can (e.g. with `str(context)`), which the crate documentation says.

import ast
import bisect
import builtins
import collections
import copy
import datetime
import decimal
import difflib
import fractions
import functools
import heapq
import io
import itertools
import json
import linecache
import math
import operator
import random
import re as _re
import statistics
import string
import sys
import textwrap
import traceback
import types
import unicodedata

sys.dont_write_bytecode = True
_PRELUDE_FILE = "<fathom-prelude>"


def make_repl(text, llm_raw, max_output, max_accesses):
    """Builds one REPL session around the document `text`; returns `run_cell`."""
    log = []
    dropped = [0]

    def record(kind, arg, start, end):
        if len(log) < max_accesses:
            log.append((kind, arg, start, end))
        else:
            dropped[0] += 1

    def bounds(n, start, end):
        s, e, _ = slice(start, end).indices(n)
        return s, max(s, e)

    class Document(str):
        """The document, or a slice of it that remembers where it came from."""

        _off = 0

        def _at(self, text, start):
            out = Document(text)
            out._off = self._off + start
            return out

        def __getitem__(self, key):
            if isinstance(key, slice):
                n = str.__len__(self)
                start, stop, step = key.indices(n)
                piece = str.__getitem__(self, key)
                if step == 1:
                    if stop > start:
                        record("slice", None, self._off + start, self._off + stop)
                    return self._at(piece, start)
                lo, hi = (start, stop) if step > 0 else (stop + 1, start + 1)
                if hi > lo:
                    record("slice", None, self._off + lo, self._off + hi)
                return piece
            return str.__getitem__(self, key)

        def _find(self, sub, start=None, end=None):
            if isinstance(sub, str):
                s, e = bounds(str.__len__(self), start, end)
                record("find", str(sub), self._off + s, self._off + e)

        def _whole(self, needle):
            record("find", needle, self._off, self._off + str.__len__(self))

        def find(self, sub, start=None, end=None):
            self._find(sub, start, end)
            return str.find(self, sub, start, end)

        def rfind(self, sub, start=None, end=None):
            self._find(sub, start, end)
            return str.rfind(self, sub, start, end)

        def index(self, sub, start=None, end=None):
            self._find(sub, start, end)
            return str.index(self, sub, start, end)

        def rindex(self, sub, start=None, end=None):
            self._find(sub, start, end)
            return str.rindex(self, sub, start, end)

        def count(self, sub, start=None, end=None):
            self._find(sub, start, end)
            return str.count(self, sub, start, end)

        def __contains__(self, sub):
            if isinstance(sub, str):
                self._whole(str(sub))
            return str.__contains__(self, sub)

        def split(self, sep=None, maxsplit=-1):
            self._whole(" " if sep is None else str(sep))
            return str.split(self, sep, maxsplit)

        def rsplit(self, sep=None, maxsplit=-1):
            self._whole(" " if sep is None else str(sep))
            return str.rsplit(self, sep, maxsplit)

        def splitlines(self, keepends=False):
            self._whole("\n")
            return str.splitlines(self, keepends)

        def partition(self, sep):
            self._whole(str(sep))
            return str.partition(self, sep)

        def rpartition(self, sep):
            self._whole(str(sep))
            return str.rpartition(self, sep)

        def _same_length(self, out):
            return self._at(out, 0) if len(out) == str.__len__(self) else out

        def lower(self):
            return self._same_length(str.lower(self))

        def upper(self):
            return self._same_length(str.upper(self))

        def casefold(self):
            return self._same_length(str.casefold(self))

        def lstrip(self, chars=None):
            out = str.lstrip(self, chars)
            return self._at(out, str.__len__(self) - len(out))

        def rstrip(self, chars=None):
            return self._at(str.rstrip(self, chars), 0)

        def strip(self, chars=None):
            return self.lstrip(chars).rstrip(chars)

    def pattern_text(pattern):
        p = getattr(pattern, "pattern", pattern)
        if isinstance(p, bytes):
            p = p.decode("latin-1")
        return str(p)

    def searched(pattern, target, pos=0, endpos=None):
        if isinstance(target, Document):
            s, e = bounds(str.__len__(target), pos, endpos)
            record("search", pattern_text(pattern), target._off + s, target._off + e)

    def real(pattern):
        return pattern._p if isinstance(pattern, Pattern) else pattern

    class Pattern:
        """A compiled pattern whose methods record what they scan."""

        __slots__ = ("_p",)

        def __init__(self, compiled):
            self._p = compiled

        pattern = property(lambda self: self._p.pattern)
        flags = property(lambda self: self._p.flags)
        groups = property(lambda self: self._p.groups)
        groupindex = property(lambda self: self._p.groupindex)

        def search(self, target, pos=0, endpos=sys.maxsize):
            searched(self._p, target, pos, endpos)
            return self._p.search(target, pos, endpos)

        def match(self, target, pos=0, endpos=sys.maxsize):
            searched(self._p, target, pos, endpos)
            return self._p.match(target, pos, endpos)

        def fullmatch(self, target, pos=0, endpos=sys.maxsize):
            searched(self._p, target, pos, endpos)
            return self._p.fullmatch(target, pos, endpos)

        def findall(self, target, pos=0, endpos=sys.maxsize):
            searched(self._p, target, pos, endpos)
            return self._p.findall(target, pos, endpos)

        def finditer(self, target, pos=0, endpos=sys.maxsize):
            searched(self._p, target, pos, endpos)
            return self._p.finditer(target, pos, endpos)

        def split(self, target, maxsplit=0):
            searched(self._p, target)
            return self._p.split(target, maxsplit)

        def sub(self, repl, target, count=0):
            searched(self._p, target)
            return self._p.sub(repl, target, count)

        def subn(self, repl, target, count=0):
            searched(self._p, target)
            return self._p.subn(repl, target, count)

        def __repr__(self):
            return repr(self._p)

        def __eq__(self, other):
            return self._p == real(other)

        def __hash__(self):
            return hash(self._p)

    re_mod = types.ModuleType("re", _re.__doc__)
    re_mod.__dict__.update({k: v for k, v in _re.__dict__.items() if not k.startswith("__")})

    def scanning(name, target_at):
        fn = getattr(_re, name)

        def wrapper(pattern, *args, **kwargs):
            target = args[target_at] if len(args) > target_at else kwargs.get("string")
            searched(pattern, target)
            return fn(real(pattern), *args, **kwargs)

        wrapper.__name__ = wrapper.__qualname__ = name
        wrapper.__doc__ = fn.__doc__
        return wrapper

    for name in ("search", "match", "fullmatch", "findall", "finditer", "split"):
        setattr(re_mod, name, scanning(name, 0))
    for name in ("sub", "subn"):
        setattr(re_mod, name, scanning(name, 1))

    def compile_(pattern, flags=0):
        return pattern if isinstance(pattern, Pattern) else Pattern(_re.compile(pattern, flags))

    re_mod.compile = compile_
    re_mod.Pattern = Pattern
    sys.modules["re"] = re_mod

    def llm(prompt):
        """Ask the sub-language model about `prompt` (a str); returns its reply as a str."""
        if not isinstance(prompt, str):
            raise TypeError(f"llm() expects a str prompt, got {type(prompt).__name__}")
        return llm_raw(str.__str__(prompt))

    document = Document(text)
    document._off = 0
    namespace = {
        "__name__": "__main__",
        "__builtins__": builtins,
        "context": document,
        "llm": llm,
        "re": re_mod,
    }

    class Capture(io.TextIOBase):
        """A text stream that keeps the first `max_output` characters written to it."""

        def __init__(self):
            self.parts = []
            self.kept = 0
            self.lost = 0

        def writable(self):
            return True

        def write(self, s):
            if not isinstance(s, str):
                raise TypeError(f"write() argument must be str, not {type(s).__name__}")
            room = max_output - self.kept
            if len(s) <= room:
                self.parts.append(s)
                self.kept += len(s)
            else:
                if room > 0:
                    self.parts.append(s[:room])
                    self.kept += room
                self.lost += len(s) - max(room, 0)
            return len(s)

        def text(self):
            out = "".join(self.parts)
            if self.lost:
                out += f"\n[... output truncated: {self.lost} more characters not shown ...]\n"
            return out

    cells = [0]

    def describe(exc):
        try:
            frames = [
                f for f in traceback.extract_tb(exc.__traceback__) if f.filename != _PRELUDE_FILE
            ]
            lines = traceback.format_exception_only(type(exc), exc)
            if frames:
                lines = ["Traceback (most recent call last):\n"] + traceback.format_list(frames) + lines
            return "".join(lines)
        except BaseException:
            return f"{type(exc).__name__}: <exception could not be formatted>\n"

    def run_cell(code):
        cells[0] += 1
        filename = f"<cell {cells[0]}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        out, err = Capture(), Capture()
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        error = None
        try:
            tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST)
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, filename, "exec"), namespace)
            if last is not None:
                value = eval(compile(last, filename, "eval"), namespace)
                if value is not None:
                    out.write(repr(value) + "\n")
        except BaseException as exc:
            error = describe(exc)
        finally:
            sys.stdout, sys.stderr = saved
        records = log[:]
        log.clear()
        lost = dropped[0]
        dropped[0] = 0
        truncated = bool(out.lost or err.lost)
        return out.text(), err.text(), error, truncated, records, lost

    return run_cell

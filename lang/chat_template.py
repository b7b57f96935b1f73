"""Role markers taken from the model's own chat template.

The template is rendered with sentinel contents, and the text around each sentinel becomes that
role's begin and end markers; what a template puts before a lone user message (a default system
prompt, a BOS) becomes the preamble used when a program starts without a system role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

Render = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> text

_S, _U, _A = "\x11SYS\x11", "\x11USR\x11", "\x11AST\x11"


@dataclass(frozen=True)
class ChatRoles:
    begin: dict[str, str]
    end: dict[str, str]
    preamble: str  # before the first role when a program gives no system message

    def role_begin(self, role: str, first: bool) -> str:
        return (self.preamble if first and role != "system" else "") + self.begin[role]


def derive_roles(render: Render) -> ChatRoles:
    sys_only = render([{"role": "system", "content": _S}], False)
    su = render([{"role": "system", "content": _S}, {"role": "user", "content": _U}], False)
    sua = render([{"role": "system", "content": _S}, {"role": "user", "content": _U},
                  {"role": "assistant", "content": _A}], False)
    if not (su.startswith(sys_only) and sua.startswith(su)):
        raise ValueError("the chat template does not render a conversation as a sequence of messages")
    i = sys_only.index(_S)
    begin = {"system": sys_only[:i]}
    end = {"system": sys_only[i + len(_S):]}
    tail = su[len(sys_only):]
    j = tail.index(_U)
    begin["user"], end["user"] = tail[:j], tail[j + len(_U):]
    tail = sua[len(su):]
    k = tail.index(_A)
    begin["assistant"], end["assistant"] = tail[:k], tail[k + len(_A):]
    gen_prompt = render([{"role": "system", "content": _S}, {"role": "user", "content": _U}], True)[len(su):]
    if gen_prompt and gen_prompt != begin["assistant"]:
        begin["assistant"] = gen_prompt  # the template's own generation prompt wins
    lone = render([{"role": "user", "content": _U}], False)
    preamble = lone[: lone.index(_U)]
    preamble = preamble[: len(preamble) - len(begin["user"])] if preamble.endswith(begin["user"]) else ""
    return ChatRoles(begin, end, preamble)


def jinja_render(template: str, bos: str = "", eos: str = "") -> Render:
    """A Render for a template string alone (a server's /get_model_info), as transformers renders it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str):
        raise ValueError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    tmpl = env.from_string(template)
    return lambda messages, gen: tmpl.render(messages=messages, add_generation_prompt=gen, bos_token=bos,
                                             eos_token=eos)


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

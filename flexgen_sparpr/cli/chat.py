"""`flexgen-sparpr chat`: a conversation in the terminal, streamed, with its KV cache kept
between turns (api/chat.py): a turn prefills only its own tokens.

Takes run's model, placement, KV policy, sampling and YAML flags. Commands: /reset (a new
conversation), /stats (context tokens, KV bytes per tier, the last turn's positions prefilled,
tok/s and share of the cache read), /help, /exit. Ctrl-C stops an answer (the conversation
goes on; at the prompt it clears the line), Ctrl-D or /exit ends the chat.
"""
from __future__ import annotations

import argparse
import signal
from contextlib import contextmanager

from ..api.chat import ChatSession
from ..api.llm import LLM
from ..errors import ConfigError
from ..weights.resolve import SMOLLM2
from .parser import GLOSSARY, build_parser
from ..config.options import resolve

# run's flags a chat has no use for: its prompts are typed, its answers end at the end token
PER_TURN = ("prompt", "prompt_file", "prompt_ids_file", "gen_len", "cut_gen_len", "stop", "stream", "output_json",
            "log_file", "no_log", "warmup", "debug_mode", "chat")
OWN = ("max_context", "max_tokens", "system")
HELP = ("/reset  start a new conversation    /stats  context, KV bytes per tier, the last turn's costs\n"
        "/help   this text                   /exit   end (Ctrl-D too; Ctrl-C stops an answer)")


def build_chat_parser() -> argparse.ArgumentParser:
    p = build_parser("flexgen-sparpr chat")
    p.description = ("Chat with an instruction-tuned model in the terminal: its chat template, streamed answers, "
                     "and the conversation's KV cache kept between turns (a turn prefills only its own tokens), "
                     "with run's model, placement, KV policy, sampling and --config flags.")
    p.epilog = HELP.replace("\n", " ") + " " + GLOSSARY
    for action in p._actions:
        if action.dest in PER_TURN:
            action.help = argparse.SUPPRESS
    g = p.add_argument_group("chat")
    g.add_argument("--max-context", type=int, help="tokens the conversation may hold (its KV cache is made for "
                   "that many; default: the model's context, at most 8192)")
    g.add_argument("--max-tokens", type=int, default=512, help="longest answer, in tokens (default 512)")
    g.add_argument("--system", help="a system message (default: the chat template's own)")
    return p


def chat(argv=None) -> int:
    args = build_chat_parser().parse_args(argv)
    if args.model is None and args.path is None and args.config is None:
        args.model = SMOLLM2  # the instruction-tuned model `prepare` fetches (one line if it is not prepared)
    given = {k: v for k, v in vars(args).items() if v is not None and k not in OWN}
    for key in PER_TURN:
        if key in given:
            raise ConfigError(f"chat takes no --{key.replace('_', '-')}: type the prompts; answers end at the "
                              "end token (--max-tokens caps them)")
    opts, _, _ = resolve(given)  # every flag checked before anything loads
    model_args = {k: v for k, v in given.items() if k not in ("model", "seed", "do_sample", "temperature", "top_p")}
    sampling = dict(do_sample=opts.do_sample, temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)
    with LLM(opts.model, quiet=True, **model_args) as llm:
        session = ChatSession(llm, max_context=args.max_context, max_tokens=args.max_tokens, system=args.system,
                              sampling=sampling)
        print(f"chatting with {opts.model} (KV policy {llm.engine.kv_policy.name}, up to {session.max_context} "
              f"tokens); /help for commands", flush=True)
        with _ctrl_c() as answering:
            while True:
                try:
                    if not _turn(session, answering):
                        break
                except KeyboardInterrupt:  # Ctrl-C between the prompt and the answer
                    print(flush=True)
    return 0


class _Answering:
    """Whether an answer is being generated, and whether Ctrl-C asked it to stop."""
    busy = False
    stopped = False


@contextmanager
def _ctrl_c():
    """Ctrl-C (SIGINT) while answering ends the answer after the current step (the cache stays
    whole); at the prompt it raises KeyboardInterrupt (a fresh line)."""
    state = _Answering()

    def handler(signum, frame):
        if not state.busy:
            raise KeyboardInterrupt
        state.stopped = True
    old = signal.signal(signal.SIGINT, handler)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, old)


def _turn(session: ChatSession, answering: _Answering) -> bool:
    """One prompt and its answer (or a command); False when the chat ends."""
    try:
        line = input(">>> ")
    except EOFError:  # Ctrl-D
        print()
        return False
    except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, as a shell does
        print()
        return True
    cmd = line.strip()
    if cmd in ("/exit", "/quit"):
        return False
    if cmd == "/help":
        print(HELP)
    elif cmd == "/reset":
        session.reset()
        print("(a new conversation)")
    elif cmd == "/stats":
        print(format_stats(session.stats()))
    elif cmd.startswith("/"):
        print(f"unknown command {cmd.split()[0]} (/help lists them)")
    elif cmd:
        answering.busy, answering.stopped = True, False
        try:
            for piece in session.send(line, interrupted=lambda: answering.stopped):
                print(piece, end="", flush=True)
            print(" [stopped]" if answering.stopped else "", flush=True)
        except ConfigError as e:  # a full context, an empty message: the chat goes on
            print(f"error: {' '.join(str(e).split())}", flush=True)
        finally:
            answering.busy = False
    return True


def format_stats(s: dict) -> str:
    t = s["last_turn"]
    kv = ", ".join(f"{tier} {n / 2 ** 20:.1f} MiB" for tier, n in s["kv_bytes"].items())
    share = "-" if t["kv_read_share"] is None else f"{t['kv_read_share']:.0%}"
    return (f"context {s['context_tokens']} / {s['max_context']} tokens; KV ({s['kv_policy']}): {kv}\n"
            f"last turn: {t['positions_prefilled']} positions prefilled in {t['prefill_s']:.2f} s, "
            f"{t['answer_tokens']} answer tokens at {t['decode_tok_per_s']:.1f} tok/s, {share} of the cached "
            f"blocks read, ended: {t['ended'] or '-'}")

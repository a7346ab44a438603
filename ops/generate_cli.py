"""`pagoda generate`: run prompts through the offline engine and print the completions."""
import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shared.engine_args import EngineArgs
    parser.add_argument("prompts", nargs="+", help="prompt texts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    from pagoda import LLM, EngineArgs, SamplingParams
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**engine_args.to_dict())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs):
        print(f"--- {prompt!r}\n{out.outputs[0].text}")
    return 0

"""`pagoda bench throughput | serve | kernels | matmuls | parallel | latency | spec`."""
import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    from ops.bench import spec
    spec.add_arguments(sub.add_parser("spec", help=spec.__doc__.split("\n")[0]))
    from ops.bench import kernels, latency, matmuls, parallel, serve, throughput
    throughput.add_arguments(sub.add_parser("throughput", help=throughput.__doc__.split("\n")[0]))
    serve.add_arguments(sub.add_parser("serve", help=serve.__doc__.split("\n")[0]))
    kernels.add_arguments(sub.add_parser("kernels", help=kernels.__doc__.split("\n")[0]))
    matmuls.add_arguments(sub.add_parser("matmuls", help=matmuls.__doc__.split("\n")[0]))
    parallel.add_arguments(sub.add_parser("parallel", help=parallel.__doc__.split("\n")[0]))
    latency.add_arguments(sub.add_parser("latency", help=latency.__doc__.split("\n")[0]))


def run(args: argparse.Namespace) -> int:
    if args.bench == "throughput":
        from ops.bench import throughput
        return throughput.run(args)
    if args.bench == "serve":
        from ops.bench import serve
        return serve.run(args)
    if args.bench == "kernels":
        from ops.bench import kernels
        return kernels.run(args)
    if args.bench == "matmuls":
        from ops.bench import matmuls
        return matmuls.run(args)
    if args.bench == "parallel":
        from ops.bench import parallel
        return parallel.run(args)
    if args.bench == "latency":
        from ops.bench import latency
        return latency.run(args)
    if args.bench == "spec":
        from ops.bench import spec
        return spec.run(args)
    raise SystemExit(f"unknown benchmark {args.bench}")

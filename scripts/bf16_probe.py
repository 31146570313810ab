"""Why AFT-conv's depthwise convolution stays float32 under bfloat16 on the CPU (docs/performance.md's figures).

    python scripts/bf16_probe.py [--sizes 14 24 48] [--threads N] [--repeats 10]

On aft_conv_small's mixer layer (384 channels, 384 heads, a 15 x 15 window, batch 8) at each token-map size, the
median milliseconds of ``--repeats`` calls after two warm-up calls, the machine otherwise idle:

1. oneDNN's depthwise convolution of the (8, 768, H, W) channels-last tokens, in float32 and in bfloat16;
2. the float32 box sum (a 1 x s then an s x 1 depthwise convolution) that an exact bfloat16 form needs: the window's
   weights ``exp(w - m)`` are positive and may run in bfloat16, but the keys outside the window must then be summed
   as the global sum less the box sum, in float32, where that difference cancels;
3. the whole mixer forward both ways, ``DepthwiseMix`` (float32 convolution) against that positive split, with the
   largest error of each against float64 (bfloat16 q, k, v);
4. element-wise data movement: ``exp(k) * v`` and the gate's sigmoid with bfloat16 operands read directly, against a
   cast to float32 first (what the mixer does).
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from aft_vision.layers.depthwise_mix import DepthwiseMix, _head_kernel
from aft_vision.layers.functional import gate


def median_ms(fn, repeats: int) -> float:
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def box_sum(x: torch.Tensor, s: int) -> torch.Tensor:
    """Unweighted s x s window sums of x (B, n, H, W), zero padded, by two 1-D depthwise convolutions."""
    n = x.shape[1]
    row = F.conv2d(x, x.new_ones(n, 1, 1, s), padding=(0, s // 2), groups=n)
    return F.conv2d(row, x.new_ones(n, 1, s, 1), padding=(s // 2, 0), groups=n)


def positive_split(q, k, v, w):
    """``sigmoid(q) * N / D`` with the window's positive weights in bfloat16 and the rest in float32 (bfloat16 out)."""
    batch, height, width, channels = q.shape
    heads, s = k.shape[-1], w.shape[-1]
    tokens = torch.empty(batch, height, width, channels + heads, dtype=torch.bfloat16)  # [exp(k) v | exp(k)]
    exp_k = (k.float() - k.float().amax(dim=(1, 2), keepdim=True)).exp_()  # (B, H, W, h)
    tokens[..., channels:].copy_(exp_k)
    exp_kv = v.float().view(batch, height, width, heads, -1) * exp_k.unsqueeze(-1)  # (B, H, W, h, d)
    tokens[..., :channels].copy_(exp_kv.flatten(3))
    _, floor, inside = _head_kernel(w)  # exp(-m) (h,), exp(w - m) (h, s, s) positive
    floor = torch.cat([floor.repeat_interleave(channels // heads), floor])  # per channel (C + h,)
    kernel = torch.cat([inside.repeat_interleave(channels // heads, 0), inside]).unsqueeze(1).bfloat16()
    x = tokens.permute(0, 3, 1, 2)  # (B, C + h, H, W), a channels-last view
    window = F.conv2d(x, kernel, padding=s // 2, groups=channels + heads).permute(0, 2, 3, 1)  # bfloat16
    exact = x.float()
    outside = exact.sum(dim=(2, 3)).view(batch, 1, 1, -1) - box_sum(exact, s).permute(0, 2, 3, 1)  # float32
    sums = outside.mul_(floor).add_(window)
    with torch.no_grad():
        return gate(q.float(), sums[..., :channels], sums[..., channels:]).bfloat16()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--sizes', type=int, nargs='+', default=[14, 24, 48], help='token-map sides (224/384/768 px)')
    parser.add_argument('--threads', type=int, default=None)
    parser.add_argument('--repeats', type=int, default=10)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    channels = heads = 384
    s, batch = 15, 8
    print(f'torch {torch.__version__}, {torch.get_num_threads()} threads, batch {batch}, C = h = {channels}, s = {s}')
    print('| map | conv f32 | conv bf16 | box sum f32 | mixer f32 conv | mixer positive split | error f32 conv | '
          'error positive split | exp(k) v: cast / bf16 read | sigmoid: f32 / bf16 |')
    print('|---|---|---|---|---|---|---|---|---|---|')
    gen = torch.Generator().manual_seed(0)
    for side in args.sizes:
        x = torch.randn(batch, side, side, channels + heads, generator=gen).permute(0, 3, 1, 2)
        kernel = torch.rand(channels + heads, 1, s, s, generator=gen)
        x16, kernel16 = x.bfloat16(), kernel.bfloat16()
        conv32 = median_ms(lambda: F.conv2d(x, kernel, padding=s // 2, groups=channels + heads), args.repeats)
        conv16 = median_ms(lambda: F.conv2d(x16, kernel16, padding=s // 2, groups=channels + heads), args.repeats)
        box = median_ms(lambda: box_sum(x, s), args.repeats)
        q, v = (torch.randn(batch, side, side, channels, generator=gen).bfloat16() for _ in 'qv')
        k = torch.randn(batch, side, side, heads, generator=gen).bfloat16()
        w = torch.randn(heads, s, s, generator=gen) * 0.5
        with torch.no_grad():
            current = lambda: DepthwiseMix.apply(q, k, v, w, False, torch.float32)[0].bfloat16()  # noqa: E731
            mixer32 = median_ms(current, args.repeats)
            split = median_ms(lambda: positive_split(q, k, v, w), args.repeats)
            exact = DepthwiseMix.apply(q.double(), k.double(), v.double(), w.double(), False, torch.float64)[0]
            error32 = (current().double() - exact).abs().max().item()
            error_split = (positive_split(q, k, v, w).double() - exact).abs().max().item()
        exp_k = torch.rand(batch, side, side, heads, 1, generator=gen)
        v5 = v.view(batch, side, side, heads, -1)
        cast = median_ms(lambda: v5.float() * exp_k, args.repeats)
        mixed = median_ms(lambda: v5 * exp_k, args.repeats)
        sig32 = median_ms(lambda: torch.sigmoid(q.float()), args.repeats)
        sig16 = median_ms(lambda: torch.sigmoid(q), args.repeats)
        print(f'| {side}x{side} | {conv32:.2f} | {conv16:.2f} | {box:.2f} | {mixer32:.2f} | {split:.2f} | '
              f'{error32:.1e} | {error_split:.1e} | {cast:.2f} / {mixed:.2f} | {sig32:.2f} / {sig16:.2f} |')


if __name__ == '__main__':
    main()

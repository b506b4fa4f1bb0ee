"""Which network makes the small StyleGAN2 collapse on MNIST? A bare GAN loop outside ganscale's trainer
(non-saturating loss, R1 every 16 steps, batch 32, MNIST at 32 px) with either G and either D swapped for the
DCGAN's, printing every 200 steps the effective number of classes G draws (exp of the entropy of the shipped
MNIST classifier's predictions on 1,000 samples) and G's pixel diversity (mean pairwise distance over the reals').

    OMP_NUM_THREADS=1 python benchmarks/probes/stylegan2_mnist_swap.py --g stylegan2 --d dcgan [--tanh]

Results: benchmarks/results/mnist-stylegan2-collapse-20261126.md."""
import argparse

import torch
import torch.nn.functional as F
from diversity import classes_and_diversity  # benchmarks/probes/diversity.py, beside this script

from ganscale.data.mnist import mnist
from ganscale.metrics import digits_classifier
from ganscale.models.dcgan import DCGANDiscriminator, DCGANGenerator
from ganscale.models.stylegan2 import StyleGAN2Discriminator, StyleGAN2Generator

Z, BATCH, RES, R1_EVERY = 64, 32, 32, 16

parser = argparse.ArgumentParser()
parser.add_argument("--g", choices=["stylegan2", "dcgan"], default="stylegan2")
parser.add_argument("--d", choices=["stylegan2", "dcgan"], default="stylegan2")
parser.add_argument("--tanh", action="store_true", help="StyleGAN2 G's output through tanh")
parser.add_argument("--channel-base", type=int, default=512)
parser.add_argument("--channel-max", type=int, default=32)
parser.add_argument("--r1-gamma", type=float, default=0.05)
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
reals = mnist(RES)[:][0]
classifier, _ = digits_classifier.load(dataset="mnist")
stylegan2_adam, dcgan_adam = {"lr": 0.002, "betas": (0.0, 0.99)}, {"lr": 0.0002, "betas": (0.5, 0.999)}
if args.g == "stylegan2":
    G = StyleGAN2Generator(RES, Z, 1, 0, 2, args.channel_base, args.channel_max, 0.9, "tanh" if args.tanh else "linear")
else:
    G = DCGANGenerator(Z, 1, RES, 64)
D = (StyleGAN2Discriminator(RES, 1, 0, args.channel_base, args.channel_max, 4) if args.d == "stylegan2"
     else DCGANDiscriminator(1, RES, 64))
opt_g = torch.optim.Adam(G.parameters(), **(stylegan2_adam if args.g == "stylegan2" else dcgan_adam))
opt_d = torch.optim.Adam(D.parameters(), **(stylegan2_adam if args.d == "stylegan2" else dcgan_adam))


_, real_diversity = classes_and_diversity(reals[torch.randperm(len(reals))[:1000]], classifier)
for step in range(1, args.steps + 1):
    real = reals[torch.randint(0, len(reals), (BATCH,))]
    with torch.no_grad():
        fake = G(torch.randn(BATCH, Z))
    with_r1 = step % R1_EVERY == 0 and args.r1_gamma > 0
    real.requires_grad_(with_r1)
    real_logits, fake_logits = D(torch.cat([real, fake])).chunk(2)
    loss_d = F.softplus(-real_logits).mean() + F.softplus(fake_logits).mean()
    if with_r1:
        grad, = torch.autograd.grad(real_logits.sum(), real, create_graph=True)
        loss_d = loss_d + 0.5 * args.r1_gamma * R1_EVERY * grad.square().sum((1, 2, 3)).mean()
    opt_d.zero_grad()
    loss_d.backward()
    opt_d.step()
    D.requires_grad_(False)
    loss_g = F.softplus(-D(G(torch.randn(BATCH, Z)))).mean()
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()
    D.requires_grad_(True)
    if step % 200 == 0:
        G.eval()
        with torch.no_grad():
            classes, diversity = classes_and_diversity(G(torch.randn(1000, Z, generator=torch.Generator().manual_seed(1))),
                                                       classifier)
        G.train()
        print(f"G {args.g}{' (tanh)' if args.tanh else ''} D {args.d} step {step}: loss_d {loss_d.item():.3f} loss_g {loss_g.item():.3f} "
              f"classes {classes:.1f} diversity {diversity / real_diversity:.2f}", flush=True)

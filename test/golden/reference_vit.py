"""Reference Vision Transformer: timm's VisionTransformer, rewritten in plain PyTorch.

This is the independent judge of the golden test, so it follows timm's code
(timm/models/vision_transformer.py, class_token=True, global_pool='token', no register
tokens, no layer scale, qkv_bias=True, pre-norm, LayerNorm eps 1e-6) and not vitgrid's:
module nesting and parameter names equal timm's state_dict keys, so load_state_dict(strict=True)
of a vitgrid checkpoint (or of the golden dump) is itself the naming-contract check.

Deliberately written the way timm computes, not the way vitgrid does: the final LayerNorm
normalises every token (vitgrid normalises only the class token), attention is the explicit
softmax(q k^T * scale) v, and the patch embedding is a real Conv2d.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-6


class PatchEmbed(nn.Module):
    def __init__(self, img_size, patch_size, in_chans, embed_dim):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size,
                              bias=True)

    def forward(self, x):
        x = self.proj(x)                      # [B, C, S/P, S/P]
        return x.flatten(2).transpose(1, 2)   # [B, N, C], patches row-major over the image


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        assert dim % num_heads == 0
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)               # each [B, H, N, hd]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x = attn @ v                          # [B, H, N, hd]
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, dim, hidden, gelu_approximate):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate=gelu_approximate)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_hidden, gelu_approximate):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, mlp_hidden, gelu_approximate)
        # drop path (timm's DropPath in training): per-sample factors of the attention and MLP
        # branches, mask / keep probability, set from outside ([B] each) or None
        self.path_scale = None

    def forward(self, x):
        s = self.path_scale
        a = self.attn(self.norm1(x))
        x = x + (a if s is None else a * s[0][:, None, None])
        m = self.mlp(self.norm2(x))
        x = x + (m if s is None else m * s[1][:, None, None])
        return x


class VisionTransformer(nn.Module):
    def __init__(self, img_size, patch_size, in_chans, num_classes, embed_dim, depth, num_heads,
                 mlp_hidden, gelu="exact"):
        super().__init__()
        approx = {"exact": "none", "tanh": "tanh"}[gelu]
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_tokens = self.patch_embed.num_patches + 1
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim))
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads, mlp_hidden, approx)
                                      for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=LN_EPS)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward_features(self, x):
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embed
        x = self.blocks(x)
        return self.norm(x)

    def forward(self, x):
        x = self.forward_features(x)
        return self.head(x[:, 0])             # class-token pooling


def from_config(attrs, gelu):
    """Builds the reference model from the golden file's root attributes."""
    return VisionTransformer(img_size=int(attrs["image"]), patch_size=int(attrs["patch"]),
                             in_chans=int(attrs["channels"]), num_classes=int(attrs["classes"]),
                             embed_dim=int(attrs["hidden"]), depth=int(attrs["depth"]),
                             num_heads=int(attrs["heads"]), mlp_hidden=int(attrs["mlp"]),
                             gelu=gelu)

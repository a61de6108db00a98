#!/usr/bin/env python3
# Manual check (not run by ctest: about 2 CPU minutes): a small timm-style ViT (dim 64, depth 4,
# patch 4) trained with PyTorch on the synthetic set, with random horizontal flips, must reach
# >= 90% eval top-1 within a couple of minutes on one core. Measured while writing the dataset:
# 94% after 200 steps of batch 128, 98% after ~400 steps (~2 min, one thread).
#   build/bin/vitgrid_dataset synthetic /tmp/syn --train 20000 --eval 2000 --size 32 --classes 10 --seed 42
#   /usr/bin/python3 test/data/synthetic_learnability.py /tmp/syn [threads] [seconds]
import h5py, numpy as np, torch, torch.nn as nn, time, sys
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv)>2 else 1); torch.manual_seed(0)
pre=sys.argv[1]
f=h5py.File(pre+'_train.h5','r'); x=torch.tensor(f['images'][:]).permute(0,3,1,2).float()/255; y=torch.tensor(f['labels'][:]).long()
g=h5py.File(pre+'_eval.h5','r'); xe=torch.tensor(g['images'][:]).permute(0,3,1,2).float()/255; ye=torch.tensor(g['labels'][:]).long()
m=x.mean((0,2,3),keepdim=True); s=x.std((0,2,3),keepdim=True); x=(x-m)/s; xe=(xe-m)/s
D=64; P=4; T=(32//P)**2
class ViT(nn.Module):
    def __init__(s):
        super().__init__(); s.pe=nn.Conv2d(3,D,P,P); s.cls=nn.Parameter(torch.zeros(1,1,D)); s.pos=nn.Parameter(torch.randn(1,T+1,D)*.02)
        s.blocks=nn.TransformerEncoder(nn.TransformerEncoderLayer(D,4,2*D,0.0,activation='gelu',batch_first=True,norm_first=True),4)
        s.norm=nn.LayerNorm(D); s.head=nn.Linear(D,10)
    def forward(s,x):
        t=s.pe(x).flatten(2).transpose(1,2); t=torch.cat([s.cls.expand(len(t),-1,-1),t],1)+s.pos
        return s.head(s.norm(s.blocks(t))[:,0])
net=ViT(); opt=torch.optim.AdamW(net.parameters(),2e-3,weight_decay=0.05)
budget=float(sys.argv[3]) if len(sys.argv)>3 else 150; t0=time.time(); step=0; B=128
total=int(budget*20)  # rough guess steps for cosine
while time.time()-t0<budget:
    idx=torch.randint(0,len(x),(B,)); xb=x[idx]
    if torch.rand(1)<0.5: xb=xb.flip(3)
    loss=nn.functional.cross_entropy(net(xb),y[idx]); opt.zero_grad(); loss.backward(); opt.step(); step+=1
    if step%100==0:
        with torch.no_grad(): acc=(net(xe[:1000]).argmax(1)==ye[:1000]).float().mean().item()
        print(f"{time.time()-t0:.0f}s step {step} loss {loss.item():.3f} eval {acc:.3f}", flush=True)
with torch.no_grad(): acc=(net(xe).argmax(1)==ye).float().mean().item()
print("final", step, acc)

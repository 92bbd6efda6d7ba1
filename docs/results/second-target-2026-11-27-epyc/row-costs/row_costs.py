"""What a verified row costs on this CPU in each weight format: Qwen2.5-Coder-0.5B's four projection shapes
(qkv 1152x896, o 896x896, gate_up 9728x896, down 896x4864) with random weights, timed for 1-64 rows and scaled to
its 24 layers. f32/bf16: dense F.linear; int4*: aten._weight_int4pack_mm_for_cpu (groups of 32) with float32 or
bfloat16 activations; int8*: aten._weight_int8pack_mm (int8 weights, a scale per output channel). Output: output.txt.
"""
import torch, time, statistics as st
torch.set_num_threads(2)
torch.manual_seed(0)
shapes=[(1152,896),(896,896),(9728,896),(896,4864)]
G=32
def mk(out,k):
    w=torch.randn(out,k)*0.02
    q=torch.randint(0,16,(out,k),dtype=torch.int32)
    packed=torch.ops.aten._convert_weight_to_int4pack_for_cpu(q,1)
    sz=torch.stack([torch.rand(out,k//G)*0.01, torch.zeros(out,k//G)],-1).transpose(0,1).contiguous()
    w8=torch.randint(-127,127,(out,k),dtype=torch.int8); s8=torch.rand(out)*0.01
    return dict(f32=w, bf16=w.bfloat16(), packed=packed, sz=sz, szb=sz.bfloat16(), w8=w8, s8=s8, s8b=s8.bfloat16())
L=[mk(*s) for s in shapes]
def run(kind,x):
    for l in L:
        xx = x[:, :l['f32'].shape[1]].contiguous()
        if kind=='f32': torch.nn.functional.linear(xx,l['f32'])
        elif kind=='bf16': torch.nn.functional.linear(xx.bfloat16(),l['bf16'])
        elif kind=='int4bf16': torch.ops.aten._weight_int4pack_mm_for_cpu(xx.bfloat16(),l['packed'],G,l['szb'])
        elif kind=='int4f32': torch.ops.aten._weight_int4pack_mm_for_cpu(xx,l['packed'],G,l['sz'])
        elif kind=='int8f32': torch.ops.aten._weight_int8pack_mm(xx,l['w8'],l['s8'])
        elif kind=='int8bf16': torch.ops.aten._weight_int8pack_mm(xx.bfloat16(),l['w8'],l['s8b'])
kinds=['f32','bf16','int4bf16','int4f32','int8f32','int8bf16']
for m in [1,2,4,8,16,32,64]:
    x=torch.randn(m,4864)
    res={}
    for k in kinds:
        try:
            run(k,x)
            ts=[]
            for _ in range(7):
                t=time.perf_counter(); run(k,x); ts.append(time.perf_counter()-t)
            res[k]=st.median(ts)*1e3*24  # per 24 layers
        except Exception as e: res[k]=float('nan'); print(k, e)
    print(m, "  ".join(f"{k}={v:7.1f}" for k,v in res.items()))
